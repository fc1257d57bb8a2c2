"""leanfa's measurement system: ``leanfa bench``, ``leanfa accuracy``, ``leanfa profile``.

One concern per module:

* :mod:`.shapes` — benchmark cases (standard sweep, model presets, varlen, serving batches with
  chunked prefill) and FLOP counts;
* :mod:`.inputs` — Q/K/V for a case (never zeros) and copies for L2 rotation;
* :mod:`.impls` — the implementations compared (leanfa backends, cuDNN, FA2/3/4, FlashInfer)
  and whether each can run here;
* :mod:`.cudnn_graphs` — cuDNN frontend graphs (FP8 ``sdpa_fp8``, varlen BF16);
* :mod:`.fa3` — FlashAttention-3 (the ``fa3-fwd`` wheel): module, FP8 descales, the call;
* :mod:`.peers` — the peers of each precision and every row's ratio to the best one;
* :mod:`.timing` — CUDA-event timing with warm-up, medians and input rotation;
* :mod:`.power` — NVML sampler thread (SM clock, power, throttle reasons);
* :mod:`.gemm` — cuBLAS BF16/FP8 GEMM rates measured in the same run;
* :mod:`.errors` — error metrics and the float64 reference on a head subset;
* :mod:`.runner` — the check-then-time loop and ratios (to cuDNN, to the best peer);
* :mod:`.accuracy` — ``leanfa accuracy``;
* :mod:`.model_accuracy` — ``leanfa accuracy --model``: a random Llama-shaped transformers model's prefill
  with each attention implementation (time, attention share, logits error);
* :mod:`.profile` / :mod:`.profile_child` — ``leanfa profile`` under Nsight Compute;
* :mod:`.report` / :mod:`.env` — JSON, markdown, PNG; environment and output folder;
* :mod:`.cli` — argument parsing; ``leanfa.cli`` calls :func:`.cli.main`.

Nothing here is imported by ``import leanfa``; the modules import torch/leanfa lazily
where they can so that ``--help`` and the CPU tests stay light.
"""

from .commands import main

__all__ = ["main"]
