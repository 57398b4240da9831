"""Tree policies: each turns a DraftOutput into a DraftTree (torch and networkx backends)."""
