"""`python -m proxy.bench.mock`: see serve.py."""

from proxy.bench.mock.serve import main

main()
