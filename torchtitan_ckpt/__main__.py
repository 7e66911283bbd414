"""`python -m torchtitan_ckpt ...` is the `torchtitan-ckpt` command, for an environment whose
scripts folder is not on the PATH (a venv used without activating it, `pip install --user`)."""

from .cli import entry

if __name__ == "__main__":  # a tool importing every module of the package (docs, a scan) runs nothing
    entry()
