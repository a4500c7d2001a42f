"""Demo applications built on Waltz (``make demo`` runs :mod:`demo.run`)."""
