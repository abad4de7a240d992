"""The root of the test tree: being a conftest, it puts this folder on the import path, so every
test can import the shared kits here (`peerkit`)."""
