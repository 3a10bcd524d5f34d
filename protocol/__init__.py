"""The wire: request and frame types, one decoder for a line, one encoder for frames."""
