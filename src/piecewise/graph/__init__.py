"""FX analysis as pure functions: split a traced graph, find in-place writes, follow the token dimension."""
