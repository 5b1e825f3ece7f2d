"""Who reads which sample: rank and worker arithmetic, distributed coordination."""
