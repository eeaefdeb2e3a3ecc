"""``python -m rallypoint ...``: the ``rallypoint`` command, for job scripts that launch
Python modules (Slurm batch files, Kubernetes commands), as ``python -m torch.distributed.run``
is torchrun. The CLI is imported here only, when run: the library never imports it."""

if __name__ == "__main__":
    from rallypoint_cli.main import console_main

    console_main()
