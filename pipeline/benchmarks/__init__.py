"""Benchmarks behind ``sluice bench``. Each one measures sluice against a reference in the same run, on the same
machine and server, and reports the ratio: these machines are shared and noisy, so absolute numbers mean little."""
