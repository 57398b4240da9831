"""A/B benchmarking of methods: raw JSONL records, derived tables with paired intervals, plots."""
