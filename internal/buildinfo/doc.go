// Package buildinfo owns what the binary knows about its own build: the
// module version, VCS revision and time, whether the tree was dirty, and the
// Go version (runtime/debug.ReadBuildInfo). `kvactors version` prints it and
// the metric kvactors_build_info exports it.
package buildinfo
