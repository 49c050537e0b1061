"""A chat template that a request brings: refused unless the operator trusts them, and then
rendered where it cannot hurt the server.

A chat template is a program (Jinja). Rendered in the server, a 27-byte one,
``{{ "a" * 300000000 }}``, made a 300 MB prompt, and the tokenizer's native code then
asked for 8 GB and aborted the whole process: no ``except`` can catch that. Jinja's
sandbox bounds each ``range`` but not a string product, a filter such as
``center(10**9)`` or nested loops. So, as vLLM does::

    request with chat_template (or chat_template_kwargs["chat_template"])
      server without --trust-request-chat-template ........ 400, before anything renders
      server with it: render in a child process (os.fork) under two bounds
          memory   RLIMIT_AS: the parent's address space + RENDER_MEMORY_BYTES
          time     $VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT seconds (vLLM's name), then SIGKILL
        and the text it made must fit the context before anyone tokenizes it
        (``check_text_fits``: at least len(text) / longest-token tokens)

    parent (a tokenizer thread)                        child (a copy of the server)
    fork ──────────────────────────────────────────>   setrlimit(RLIMIT_AS)
    wait on the pipe, at most the deadline             render with the tokenizer's Jinja
      JSON {"text"} | {"error", "kind"}  <──── pipe ─   check the text's length, write, _exit
      nothing by the deadline -> SIGKILL, 400
      the child died (out of memory) -> 400

The child only renders (pure Python; it never touches the tokenizer's native code or
torch), writes its answer and leaves with ``os._exit``: none of the server's exit
handlers run in it. Without ``os.fork`` (Windows) a trusted template renders in place,
with the length check alone.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time

from microvllm import envs

# What a child may add to the server's address space while it renders.
RENDER_MEMORY_BYTES = 1 << 30

UNTRUSTED = ("chat_template: a chat template is passed with the request, but this server was not started with "
             "--trust-request-chat-template, so it refuses untrusted chat templates: remove chat_template (and "
             "chat_template_kwargs.chat_template), or start the server with --trust-request-chat-template")


def request_chat_template(chat_template, in_kwargs, trusted: bool) -> str | None:
    """The template a request asks for (None: the server's): its ``chat_template``, or the
    one in its ``chat_template_kwargs`` (``in_kwargs``). ``ValueError`` when it asks for
    one and the server does not trust request templates (vLLM's ``validate_chat_template``)."""
    if chat_template is None and in_kwargs is None:
        return None
    if not trusted:
        raise ValueError(UNTRUSTED)
    template = chat_template if chat_template is not None else in_kwargs
    if not isinstance(template, str):
        raise ValueError("chat_template must be a string (a Jinja template)")
    return template


def render_bounded(render, max_chars: int, timeout: float | None = None) -> str:
    """``render()`` (returns the chat's text) in a child process bounded in memory and time;
    the text must be at most ``max_chars`` long. ``ValueError`` names the bound it broke;
    the template's own errors come back as the exception ``render`` raised (re-raised here
    as ``RenderError`` with its type's name)."""
    timeout = envs.chat_template_render_timeout() if timeout is None else timeout
    if not hasattr(os, "fork"):
        return _checked_length(render(), max_chars)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: never returns
        os.close(read_fd)
        _child(render, max_chars, write_fd)
    os.close(write_fd)
    try:
        data = _read_until(read_fd, time.monotonic() + timeout)
    finally:
        os.close(read_fd)
    if data is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise ValueError(f"chat_template took longer than {timeout:g} s to render, so it was stopped: simplify it "
                         "(the server's limit is $VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT)")
    _, status = os.waitpid(pid, 0)
    if not data:
        how = (f"signal {signal.Signals(-os.waitstatus_to_exitcode(status)).name}"
               if os.WIFSIGNALED(status) else f"exit status {os.waitstatus_to_exitcode(status)}")
        raise ValueError(f"chat_template could not be rendered: its render stopped ({how}), most likely past "
                         f"its memory limit ({RENDER_MEMORY_BYTES >> 20} MB): simplify it")
    answer = json.loads(data)
    if "text" in answer:
        return answer["text"]
    if answer["kind"] == "size":
        raise TemplateTooLarge(answer["error"])
    raise RenderError(answer["kind"], answer["error"], answer.get("lineno"))


class RenderError(Exception):
    """The template itself failed in the child: ``kind`` is the exception's type name."""

    def __init__(self, kind: str, message: str, lineno: int | None = None):
        super().__init__(message)
        self.kind, self.message, self.lineno = kind, message, lineno


class TemplateTooLarge(ValueError):
    """The render broke a size bound (its text's length, or its memory): the client's 400."""


def _checked_length(text: str, max_chars: int) -> str:
    if len(text) > max_chars:
        raise TemplateTooLarge(f"chat_template rendered {len(text):,} characters, more than this model's context can "
                         f"hold (at most {max_chars:,}): simplify the template or shorten the messages")
    return text


def _child(render, max_chars: int, write_fd: int) -> None:
    """Render under RLIMIT_AS, write one JSON answer, leave without running any exit handler."""
    code = 0
    try:
        import resource

        signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C is the server's to handle
        with open("/proc/self/statm") as statm:          # pages of address space in use now
            in_use = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (in_use + RENDER_MEMORY_BYTES, in_use + RENDER_MEMORY_BYTES))
        try:
            answer = {"text": _checked_length(render(), max_chars)}
        except TemplateTooLarge as error:
            answer = {"kind": "size", "error": str(error)}
        except MemoryError:
            answer = {"kind": "size", "error": f"chat_template needed more than {RENDER_MEMORY_BYTES >> 20} MB "
                                               "to render, so it was stopped: simplify it"}
        except Exception as error:  # noqa: BLE001 - the parent names it to the client
            answer = {"kind": type(error).__name__, "error": str(getattr(error, "message", None) or error),
                      "lineno": getattr(error, "lineno", None)}
        data = json.dumps(answer).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(write_fd, view):]
    except BaseException:  # noqa: BLE001 - whatever happens, the child must not return into the server
        code = 1
    finally:
        os._exit(code)


def _read_until(fd: int, deadline: float) -> bytes | None:
    """Everything written to ``fd`` until it closes, or None if the deadline passes first."""
    chunks = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            return None
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
