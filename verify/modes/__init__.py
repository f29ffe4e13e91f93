"""How each mode of the harness wraps the model and builds its optimizer: DMuon's modes and the
baselines, on a flat, TP or EP mesh (``build.py``, ``tp.py``, ``ep.py``, ``baselines.py``)."""
