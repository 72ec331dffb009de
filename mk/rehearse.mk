# Every stage at Qwen3-4B's real size on this machine (docs/rehearse.md): a random-weights target of
# its exact shapes, pipelines/qwen3-4b.toml's drafter settings, each stage timed with its peak RSS,
# then `dspark plan` checked against the measured peak and FlopCounterMode's count of a real step.
# Needs ~20 GB of RAM and ~25 GB of disk under runs/rehearse; run nothing else beside it.
.PHONY: rehearse rehearse-tiny

rehearse: demo-model
	$(BIN)/python -m benchmarks.rehearse --engines-python $(EBIN)/python

## The same flow on a 36-layer toy of the same vocabulary (a minute; checks the script, not sizes).
rehearse-tiny: demo-model
	$(BIN)/python -m benchmarks.rehearse --shape tiny --conversations 12 --engines-python $(EBIN)/python
