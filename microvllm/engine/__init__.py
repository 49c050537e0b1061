"""The engine: request lifecycle, the step loop, and what comes back to the user."""
