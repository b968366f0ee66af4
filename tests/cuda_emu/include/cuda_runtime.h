// cuda_runtime.h for the CPU emulation: everything lives in the shim.
#pragma once
#include "../cuda_shim.h"
