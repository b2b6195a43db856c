"""Channel and server options every role shares."""
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # raised on both ends on purpose: a long prompt's ids fit easily

# A peer that stops answering (SIGSTOP, a hung host, a cable pulled) sends no RST: without pings a
# stream to it waits for its deadline. HTTP/2 pings every KEEPALIVE_MS, while a call is open, are
# answered by the peer's transport, not its handlers, so a busy peer still answers and a frozen one
# is dropped KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS after it froze (the call fails UNAVAILABLE).
KEEPALIVE_MS = 1000
KEEPALIVE_TIMEOUT_MS = 2000

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # What actually drops the transport when a ping goes unanswered in grpc 1.8x core (measured:
    # with keepalive_timeout_ms alone a SIGSTOPped server held a stream open for good).
    ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),  # pings while a stream is quiet (a long prefill) are fine
]

# Servers accept those pings (by default they answer pings more often than every 5 minutes with
# GOAWAY "too_many_pings", which would cut every long stream).
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # And a server pings its callers too, less often: a stream whose caller froze (an orchestrator
    # under SIGSTOP) is ended, freeing the session it held, instead of waiting on it for good.
    ("grpc.keepalive_time_ms", 5 * KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 5 * KEEPALIVE_MS),
    ("grpc.http2.ping_timeout_ms", 5 * KEEPALIVE_MS),
]
