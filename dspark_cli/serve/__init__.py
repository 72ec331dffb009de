"""`dspark serve`: a small OpenAI-compatible server for a local Transformers model.

For laptops, demos and tests (the demo pipeline regenerates its data through it); production
regen points at vLLM or SGLang. `engine` generates, `batcher` groups concurrent requests,
`sampling` draws tokens, `app` is the HTTP surface, `process` starts a server as a subprocess.
"""
