"""Benchmarks that print ratios against peers and against the machine's limits (see
docs/benchmarks.md). Run them as scripts: `python bench/throughput.py --help`."""
