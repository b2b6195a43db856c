"""Channel and server options every role shares."""
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # raised on both ends on purpose: a long prompt's ids fit easily

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
