"""dspark_cli/vllm_cpu_fix: the replacement keeps Triton expand_kernel's contract in any dtype, and
its sitecustomize swaps the function in as the module is imported (a stand-in vllm package here;
vLLM's own module is tests_engines/test_vllm_cpu_fix.py's)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from dspark_cli.vllm_cpu_fix import MARKER_PREFIX, SITE_DIR, launch_env


@pytest.fixture(scope="module")
def site():
    spec = importlib.util.spec_from_file_location("dspark_vllm_cpu_site", SITE_DIR / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    before = list(sys.meta_path)
    spec.loader.exec_module(module)
    yield module
    sys.meta_path[:] = before


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_writes_each_requests_value_over_its_tokens(site, dtype):
    values = torch.tensor([0.7, 0, 0.3] if dtype.is_floating_point else [7, 0, 3], dtype=dtype)
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = torch.full((8,), -9, dtype=dtype)  # longer than the tokens: the tail stays as it was
    site.expand_kernel_impl(out, values, cu, 0, 1, MAX_NUM_TOKENS=4)
    expected = torch.tensor([values[0], values[0], 1, 1, 1, values[2], -9, -9], dtype=dtype)
    assert torch.equal(out, expected)


def test_expand_of_no_request_writes_nothing(site):
    out = torch.zeros(3)
    site.expand_kernel_impl(out, torch.empty(0), torch.empty(0, dtype=torch.int32), 0, 1)
    assert torch.equal(out, torch.zeros(3))


def test_sitecustomize_replaces_the_function_when_the_module_is_imported(tmp_path):
    pkg = tmp_path / "vllm" / "utils"
    pkg.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "cpu_triton_utils.py").write_text("def _expand_kernel_impl(*args, **kwargs):\n    return 'vllm'\n")
    probe = ("import torch; from vllm.utils import cpu_triton_utils as m; out = torch.zeros(2); "
             "m._expand_kernel_impl(out, torch.tensor([0.5]), torch.tensor([2]), 0, 1); "
             "print(m.DSPARK_EXPAND_FIX, out.tolist())")
    env = launch_env({"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          check=True, timeout=120)
    assert done.stdout.split() == ["True", "[0.5,", "0.5]"]
    assert MARKER_PREFIX in done.stderr


def test_launch_env_puts_the_site_folder_first():
    env = launch_env({"PYTHONPATH": "/x"})
    assert env["PYTHONPATH"].split(":") == [str(SITE_DIR), "/x"]
