"""Stage 2 (backend): the pass-routing compiler that generated files call, and the codegen that
writes them."""
