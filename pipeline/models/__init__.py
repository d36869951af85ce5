"""Getting a model: what `model.name` names (source.py: your folder, checked and only
read; a hub id; the tiny model) and the tiny random models built offline (tiny.py)."""
