"""Training algorithms: the pure math (`loss.py`, `advantages.py`) and one loop module per algorithm."""
