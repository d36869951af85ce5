"""Tools around the product: `pipeline tune` (tune/), the offline corpus (dev/) and the
GPU check (gpucheck.py). Nothing below imports them."""
