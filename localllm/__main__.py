"""`python -m localllm`: the same command line as the `localllm` script."""

from localllm.cli import main

main()
