import purerpc
import trio_sidecar._proto.vllm.inference_pb2 as vllm_dot_inference__pb2
import google.protobuf.struct_pb2 as google_dot_protobuf_dot_struct__pb2


class InferenceServicer(purerpc.Servicer):
    async def Generate(self, input_message):
        raise NotImplementedError()

    async def GenerateStream(self, input_message):
        raise NotImplementedError()

    @property
    def service(self) -> purerpc.Service:
        service_obj = purerpc.Service(
            "vllm.Inference"
        )
        service_obj.add_method(
            "Generate",
            self.Generate,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_inference__pb2.GenerateRequest,
                vllm_dot_inference__pb2.GenerateResponse,
            )
        )
        service_obj.add_method(
            "GenerateStream",
            self.GenerateStream,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_STREAM,
                vllm_dot_inference__pb2.GenerateRequest,
                vllm_dot_inference__pb2.GenerateResponse,
            )
        )
        return service_obj


class InferenceStub:
    def __init__(self, channel):
        self._client = purerpc.Client(
            "vllm.Inference",
            channel
        )
        self.Generate = self._client.get_method_stub(
            "Generate",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_inference__pb2.GenerateRequest,
                vllm_dot_inference__pb2.GenerateResponse,
            )
        )
        self.GenerateStream = self._client.get_method_stub(
            "GenerateStream",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_STREAM,
                vllm_dot_inference__pb2.GenerateRequest,
                vllm_dot_inference__pb2.GenerateResponse,
            )
        )