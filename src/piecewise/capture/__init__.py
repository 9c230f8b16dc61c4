"""The back half shared by every front-end: per-call state, static buffers, piece and splitting-op runners,
the graph pool and the capture session."""
