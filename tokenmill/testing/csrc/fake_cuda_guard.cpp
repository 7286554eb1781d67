// A device guard for CUDA in a CPU-only PyTorch: device 0 exists, streams are the default one. Lets fake
// (meta-backed) CUDA tensors go through the Python bindings that take a DeviceGuard (indexing, SDPA, ...).
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
using c10::Device;
using c10::DeviceType;
using c10::Stream;

struct FakeCudaGuard final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return Device(DeviceType::CUDA, 0); }
  Device getDevice() const override { return Device(DeviceType::CUDA, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device) const noexcept override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  Stream exchangeStream(Stream) const noexcept override { return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, 0)); }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
};
C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuard);
}  // namespace
