"""Sessions: `nox -s demo` sets everything up and runs the main job; `nox -s test` runs the tests;
`nox -s ascend` installs the Ascend compilers and lowers every kernel to HIVM IR with them.

Every session builds a fresh virtualenv with torch pinned (a CPU build on CPU machines) and the
five distributions installed as real, non-editable installs, exactly as users install them.

`nox -s test` is what CI runs: the whole suite on the newest Triton, the fast lane (the tests not
marked ``slow``) on the older ones. Arguments after ``--`` go to pytest after the lane's own, so
``nox -s test -- -m "not slow"`` runs the fast lane on every version and ``nox -s test -- -m ""``
the whole suite on every version.
"""

import nox

TORCH = "torch==2.13.0"
#: the GPU host's Triton, and the newest release
TRITON_VERSIONS = ["3.6.0", "3.9.0"]
DISTRIBUTIONS = [".", "plugins/dlc_cuda", "plugins/dlc_ascend", "plugins/dlc_mlu", "plugins/dlblas_kernels"]

nox.options.sessions = ["test"]
nox.options.reuse_existing_virtualenvs = False


def install(session: nox.Session, triton: str, distributions: list[str] = DISTRIBUTIONS,
            silent: bool = True) -> None:
    """``silent=False``: pip's own progress is shown (the downloads take minutes on a fresh machine)."""
    # Triton 3.6's interpreter converts 1-element arrays with int(), which NumPy 2.4 refuses.
    numpy = ["numpy<2.4"] if triton.startswith("3.6.") else []
    session.install(TORCH, f"triton=={triton}", *numpy, silent=silent)
    session.install(*distributions, silent=silent)


@nox.session
@nox.parametrize("triton", TRITON_VERSIONS)
def test(session: nox.Session, triton: str) -> None:
    """The tests (Triton kernels in the interpreter): all on the newest Triton, the fast lane on others.

    pytest takes the last ``-m`` it is given, so one after ``--`` replaces the lane's."""
    # the transformers extra: tests/integrations runs the kernels inside transformers models
    install(session, triton, [f"./{d}[transformers]" if d == "plugins/dlblas_kernels" else d for d in DISTRIBUTIONS])
    session.install("pytest", "ruff", "matplotlib", "import-linter", "hypothesis")
    session.run("ruff", "check", ".")
    session.run("lint-imports")
    lane = [] if triton == TRITON_VERSIONS[-1] else ["-m", "not slow"]
    session.run(
        "pytest", "-p", "no:cacheprovider", *lane, *session.posargs,
        env={"TRITON_INTERPRET": "1", "DLCORE_EXPECT_INSTALLED": "1", "TRITON_DEFAULT_FP_FUSION": "1"},
    )


@nox.session
def ascend(session: nox.Session) -> None:
    """The Ascend toolchain on a CPU machine: bishengir-compile from ascendnpu-ir (``dlc-ascend[tools]``),
    triton-adapter-opt fetched out of the triton-ascend wheel into the tool cache (triton-ascend itself
    never installed), the tests that need the tools, then every kernel lowered to HIVM IR."""
    install(session, TRITON_VERSIONS[0],
            ["./plugins/dlc_ascend[tools]" if d == "plugins/dlc_ascend" else d for d in DISTRIBUTIONS])
    session.install("pytest")
    session.run("dlcore", "toolchain", "fetch", "ascend")
    session.run("dlcore", "toolchain")
    session.run(
        "pytest", "-p", "no:cacheprovider", "-m", "ascend_tools", *session.posargs,
        env={"TRITON_INTERPRET": "1", "DLCORE_EXPECT_INSTALLED": "1", "TRITON_DEFAULT_FP_FUSION": "1"},
    )
    # lowering runs the real compilers: not in Triton's interpreter
    session.run("dlcore", "lower", "--all", "--target", "npu:Ascend910B2", "--stage", "hivm", "--report")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job on this machine: get_op('ffn', ...) on real inputs, checked, explained."""
    install(session, TRITON_VERSIONS[-1], silent=False)
    env = {"TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    session.run("dlcore", "plugins", env=env)
    session.run("dlcore", "check", "ffn", "--shape", "tokens=37,hidden=256,inter=96", "--dtype", "float32", env=env)
    bin_dir = session.bin
    session.log("next steps, in this virtualenv (. %s/activate; TRITON_INTERPRET=1 on a CPU):", bin_dir)
    for line in NEXT_STEPS:
        session.log("  %s", line)


#: what `nox -s demo` suggests last: the commands a newcomer tries next
NEXT_STEPS = (
    "dlcore ops                      every op and implementation; dlcore ops rms_norm: one op in full",
    "dlcore check rms_norm --shape tokens=37,hidden=256",
    "dlcore tune rms_norm --shape tokens=64,hidden=512 --budget 8     (float32 on a CPU)",
    "dlcore cache list",
    "docs/plugins.md                 write a kernel plugin of your own",
)
