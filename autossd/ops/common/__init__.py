"""Pieces shared by the ops: the launch cache, which records and replays launches."""
