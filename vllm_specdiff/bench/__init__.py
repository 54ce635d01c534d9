"""The benchmark suite behind `vllm-specdiff bench`: methods, measurement, table and plots.

methods.py parses `--methods` into engine arguments, suite.py runs the cells (prompt set x
temperature x batch size, every method in one process, medians of repeats), table.py renders
the Markdown table and plots.py the PNG figures. The CLI module only wires them together.
"""
