"""Decoding with the real target: what `dspark eval`, `calibrate` and `profile` are built from.

sampling.py   lossless rejection sampling (one verify step)
scheduler.py  Algorithm 1 (causal, early stop), async top-K, threshold, fixed
sps.py        SPS(B) tables and the profiler that measures them
specdec.py    the decoding loop: target KV cache, drafter context, joint per-round scheduling
calibrate.py  Sequential Temperature Scaling, ECE / Brier / ROC-AUC
audit.py      chi-square losslessness audit on synthetic worlds (paper Appendix A)
prompts.py    {"turns": [...]} JSONL and prompt/response artifacts → conversations
report.py     report JSON, threshold sweep, rich tables;  plots.py  the PNGs
stages.py     the three stages as library functions (manifests, resume)
"""
