//! The worker relay (being built): protocol, server and client.
