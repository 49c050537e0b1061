"""``show_file``: excerpts of the package's C++ files for the notebooks, cut by marker lines
and never re-indented line by line, so preprocessor lines survive intact."""

import pytest

from microvllm.course.show import file_excerpt, show_file


def test_an_excerpt_keeps_ifdef_and_endif_lines_intact():
    text, first, last = file_excerpt("csrc/norm_rope.cpp", start="#ifdef __AVX512BW__",
                                     end="#endif  // __AVX512BW__")
    lines = text.splitlines()
    assert lines[0] == "#ifdef __AVX512BW__"
    assert lines[-1] == "#endif  // __AVX512BW__"
    assert "#else  // portable: the same math, one element at a time (the compiler vectorizes it)" in lines
    assert last - first + 1 == len(lines)
    source = (file_excerpt("csrc/norm_rope.cpp")[0]).splitlines()
    assert source[first - 1:last] == lines   # the file's own lines, numbered as in the file


def test_an_indented_excerpt_is_dedented_as_a_block():
    text, first, _ = file_excerpt("csrc/paged_attention.cpp", start="// pass 1: q . k",
                                  end="for_each_token(key_cache, [&](int t, const T* keys) {")
    lines = text.splitlines()
    assert lines[0] == "// pass 1: q . k for every visible key"   # common indentation removed
    assert "#ifdef __AVX512F__" in lines        # at column 0 in the file: nothing to remove
    assert "if constexpr (HEAD_DIM > 0 && HEAD_DIM % 16 == 0) {" in lines
    assert "    constexpr int V = HEAD_DIM / 16;   // zmm vectors per head" in lines   # relative indent kept


def test_show_file_renders_a_cpp_block_headed_by_path_and_lines():
    markdown = show_file("csrc/activation.cpp", start="#ifdef __AVX512BW__", end="#endif").data
    header, _, body = markdown.partition("\n\n")
    _, first, last = file_excerpt("csrc/activation.cpp", start="#ifdef __AVX512BW__", end="#endif")
    assert header == f"`microvllm/csrc/activation.cpp:{first}-{last}`"
    assert body.startswith("```cpp\n#ifdef __AVX512BW__\n") and body.endswith("#endif  // __AVX512BW__\n```")


def test_a_missing_start_marker_is_an_error_that_names_it():
    with pytest.raises(ValueError, match="'no such line' does not occur in norm_rope.cpp"):
        file_excerpt("csrc/norm_rope.cpp", start="no such line")


def test_a_missing_end_marker_is_an_error_too():
    with pytest.raises(ValueError, match="'no such line' does not occur in norm_rope.cpp after line"):
        show_file("csrc/norm_rope.cpp", start="#ifdef __AVX512BW__", end="no such line")
