"""Nsight Systems SQLite exports: the parser (``parse.py``) and where NCCL's NVTX payload
fields live in an export (``payload.py``)."""
