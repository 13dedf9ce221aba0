// SPDX-License-Identifier: Apache-2.0
// Nothing: the object library kvcache_test_pch exists to build the unit tests' shared precompiled
// header (tests/CMakeLists.txt), which needs one source file to hang on.
