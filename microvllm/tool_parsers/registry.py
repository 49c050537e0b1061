"""Parsers by name, as vLLM's ``ToolParserManager`` and ``ReasoningParserManager`` keep
them: the built-in parsers are imported and registered (``load_builtins``) the first
time a name is asked for; a plugin registers its class with the ``register_module``
decorator."""

from __future__ import annotations


class ParserRegistry:
    """A subclass sets ``BUILTIN`` (the built-in parsers' names), ``KIND`` and ``FLAG``
    (for the error), and imports its built-in modules in ``load_builtins``."""

    BUILTIN: tuple[str, ...] = ()
    KIND = "parser"
    FLAG = ""
    registered: dict[str, type]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.registered = {}

    @classmethod
    def register_module(cls, name: str):
        def register(parser_class: type) -> type:
            cls.registered[name] = parser_class
            return parser_class
        return register

    @classmethod
    def load_builtins(cls) -> None:
        """Import the built-in parsers' modules (each registers its class)."""

    @classmethod
    def get(cls, name: str) -> type:
        if name not in cls.registered and name in cls.BUILTIN:
            cls.load_builtins()
        if name not in cls.registered:
            raise KeyError(f"no {cls.KIND} named {name!r}: choose one of {cls.list_registered()} ({cls.FLAG})")
        return cls.registered[name]

    @classmethod
    def list_registered(cls) -> list[str]:
        return sorted(set(cls.registered) | set(cls.BUILTIN))
