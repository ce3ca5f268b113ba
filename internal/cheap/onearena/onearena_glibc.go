//go:build cgo && linux

package onearena

/*
#include <malloc.h>
#include <stdlib.h>

static void onearena_init(void) __attribute__((constructor));

static void onearena_init(void) {
#if defined(__GLIBC__) && defined(M_ARENA_MAX)
	if (getenv("MALLOC_ARENA_MAX") == NULL && getenv("GLIBC_TUNABLES") == NULL) {
		mallopt(M_ARENA_MAX, 1);
	}
#endif
}
*/
import "C"
