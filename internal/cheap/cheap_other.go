//go:build !cgo || !linux

package cheap

func trim() {}

func free() int64 { return 0 }
