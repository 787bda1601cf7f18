"""The wire: the event loop, the authenticated server and its handshake, sealing (encryption
in transit), the block protocol, and the driver's messages."""
