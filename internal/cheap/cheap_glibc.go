//go:build cgo && linux

package cheap

/*
#include <malloc.h>

static void cheap_trim(void) {
#if defined(__GLIBC__)
	malloc_trim(0);
#endif
}
*/
import "C"

func trim() { C.cheap_trim() }
