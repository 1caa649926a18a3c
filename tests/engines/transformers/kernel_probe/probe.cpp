// A kernel extension that compiles in a second: the loader's tests build it in place of
// the real kernels, whose builds take minutes on a busy machine.
#include <Python.h>

#define PROBE_CONCAT(a, b) a##b
#define PROBE_INIT(name) PROBE_CONCAT(PyInit_, name)

static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }

static PyMethodDef probe_methods[] = {
    {"answer", answer, METH_NOARGS, "42"},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef probe_module = {PyModuleDef_HEAD_INIT, "probe", nullptr, -1, probe_methods};

PyMODINIT_FUNC PROBE_INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&probe_module); }
