"""leanfa's measurement system: ``leanfa bench``, ``leanfa accuracy``, ``leanfa profile``.

One concern per module:

* :mod:`.shapes` — benchmark cases (standard sweep, model presets, varlen) and FLOP counts;
* :mod:`.inputs` — Q/K/V for a case (never zeros) and copies for L2 rotation;
* :mod:`.impls` — the implementations compared (leanfa backends, cuDNN, FA2/3/4, FlashInfer);
* :mod:`.cudnn_graphs` — cuDNN frontend graphs (FP8 ``sdpa_fp8``, varlen BF16);
* :mod:`.timing` — CUDA-event timing with warm-up, medians and input rotation;
* :mod:`.power` — NVML sampler thread (SM clock, power, throttle reasons);
* :mod:`.gemm` — cuBLAS BF16/FP8 GEMM rates measured in the same run;
* :mod:`.errors` — error metrics and the float64 reference on a head subset;
* :mod:`.runner` — the check-then-time loop and ratios;
* :mod:`.accuracy` — ``leanfa accuracy``;
* :mod:`.profile` / :mod:`.profile_child` — ``leanfa profile`` under Nsight Compute;
* :mod:`.report` / :mod:`.env` — JSON, markdown, PNG; environment and output folder;
* :mod:`.cli` — argument parsing; ``leanfa.cli`` calls :func:`.cli.main`.

Nothing here is imported by ``import leanfa``; the modules import torch/leanfa lazily
where they can so that ``--help`` and the CPU tests stay light.
"""

from .cli import main

__all__ = ["main"]
