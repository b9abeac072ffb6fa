"""Vision towers of the vision-language families (see engine/multimodal/base.py)."""
