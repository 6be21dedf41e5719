"""Which allocator `calm engine` gives its vLLM server (adapters/hosting/allocator.py): tcmalloc preloaded when installed, the
operator's own preload kept, the system's when asked for or when tcmalloc is missing, and the start-up line says which."""

from __future__ import annotations

from adapters.hosting.allocator import tcmalloc_library, with_allocator

LIB = "libtcmalloc_minimal.so.4"


def test_tcmalloc_is_preloaded_before_what_the_environment_preloads():
    env, said = with_allocator({"PATH": "/bin"}, "tcmalloc", LIB)
    assert env == {"PATH": "/bin", "LD_PRELOAD": LIB} and said == f"allocator: {LIB} (preloaded)"
    env, _ = with_allocator({"LD_PRELOAD": "/opt/libfoo.so"}, "tcmalloc", LIB)
    assert env["LD_PRELOAD"] == f"{LIB}:/opt/libfoo.so"


def test_an_allocator_the_operator_preloads_is_kept_and_system_means_none():
    for preload in ("/usr/lib/libjemalloc.so.2", "/x/libtcmalloc.so.4"):
        env, said = with_allocator({"LD_PRELOAD": preload}, "tcmalloc", LIB)
        assert env == {"LD_PRELOAD": preload} and preload in said
    env, said = with_allocator({}, "system", LIB)
    assert env == {} and "CALM_ENGINE_ALLOCATOR=system" in said


def test_without_tcmalloc_installed_the_line_names_the_package():
    env, said = with_allocator({}, "tcmalloc", None)
    assert env == {} and "libtcmalloc-minimal4" in said and "not installed" in said


def test_the_library_is_found_by_its_soname():
    assert tcmalloc_library() == LIB, "install Debian's libtcmalloc-minimal4 (scripts/test.sh does)"
