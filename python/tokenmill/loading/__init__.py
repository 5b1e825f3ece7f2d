"""Who reads which sample: `make_data_loader`, the thread-worker loader and the resumable mixture
loader. The rank/worker arithmetic they share (`World`, torch.distributed helpers) lives in
`tokenmill.common`, since datasets need it too; batching itself is `tokenmill.serving`."""
