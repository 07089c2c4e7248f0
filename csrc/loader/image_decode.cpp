// Implemented on branch loader-decode.
