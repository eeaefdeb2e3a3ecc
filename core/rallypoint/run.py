"""``python -m rallypoint.run ...``: ``rallypoint run ...``, under the name of torchrun's
module (``python -m torch.distributed.run``). The CLI is imported here only, when run."""

if __name__ == "__main__":
    import sys

    from rallypoint_cli.main import main

    sys.exit(main(["run", *sys.argv[1:]]))
