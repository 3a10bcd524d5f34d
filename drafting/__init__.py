"""MTP draft heads, the draft session, the speculative round driver and the depth controller."""
