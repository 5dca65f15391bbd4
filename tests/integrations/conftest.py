"""The integrations' tests need their framework: `nox -s test` installs it (the `transformers` extra of
dlblas-kernels, checked by tests/test_noxfile.py); a session without it (`nox -s ascend`) leaves them out."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("transformers") else ["test_transformers*.py"]
