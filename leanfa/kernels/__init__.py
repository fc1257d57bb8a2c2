"""Attention kernels: ``portable`` (triton.language, any Triton GPU and the CPU interpreter)
and ``hopper`` (Gluon, sm90). :mod:`leanfa.kernels.dispatch` picks one for a call."""
