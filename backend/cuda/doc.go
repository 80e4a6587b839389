// Package cuda is the CUDA device backend: it attaches an engine's GPU memory
// through CUDA IPC handles (cuIpcOpenMemHandle), allocates the host pool as
// pinned memory (cuMemHostAlloc), and copies between the two with
// cuMemcpyDtoHAsync / cuMemcpyHtoDAsync on dedicated streams, completion
// observed through one event per Copy.
//
// It owns the CUDA context of one device, the goroutine that makes its CUDA
// calls and the one waiter per stream that sees each copy end (see
// worker.go), the cgo shim for the driver calls
// gorgonia.org/cu lacks (IPC, pinned host memory), and engine-side helpers
// (Backend.AllocDevice) that tests and GPU checks use to play the engine.
//
// The real implementation needs cgo, the CUDA driver and `-tags cuda`; without
// the tag, New returns backend.ErrNotBuilt and nothing here touches cgo, so
// the default build and `go test ./...` run anywhere. Range checking, range
// merging and segment parsing are plain Go, built and tested in both builds.
// scripts/cuda-check proves the tagged build compiles and links on a machine
// without a GPU.
//
// A binary built with -tags cuda needs the CUDA driver at start-up, whatever
// backend it then uses: gorgonia.org/cu calls cuInit in its package init and
// exits the process when that fails. Ship it only to GPU hosts.
package cuda
