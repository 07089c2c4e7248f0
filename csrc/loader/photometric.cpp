// Implemented on branch loader-photometric.
