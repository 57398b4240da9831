"""Published results reproduced from their raw records: other harnesses' per-prompt JSONL read as
they are stored (`records`), a paper's table conventions as named options (`tables`), the tables
written in its layout and diffed against its CSVs (`report`), and the whole check for one paper's
repository (`reproduce`).  `treespec bench import / report / reproduce` are the command faces.
"""
